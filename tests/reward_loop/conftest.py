"""verl_tests/ holds verl's files, run by test_verl_reward_loop_tests.py through the alias, not collected."""

collect_ignore = ["verl_tests"]
