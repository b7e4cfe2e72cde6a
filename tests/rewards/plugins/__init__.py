"""Example reward functions, loaded by dotted path or file path in the contract tests."""
