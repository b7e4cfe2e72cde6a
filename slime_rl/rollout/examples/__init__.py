"""Example extension points, loadable by dotted path (each has a test in tests/rollout)."""
