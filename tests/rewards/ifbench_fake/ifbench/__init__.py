"""A stand-in for IFBench's `ifbench` package (allenai/IFBench), for tests/rewards/test_ifbench.py only: two
instruction classes with IFBench's interface (build_description with keyword-only arguments, get_instruction_args,
check_following), written for the test, not IFBench's checks."""
