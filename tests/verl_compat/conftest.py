"""verl_tests/ holds verl's own test files: they import ``verl``, so they run only through the alias, in
their own pytest (test_verl_tests_through_alias.py), never collected by this one."""

collect_ignore = ["verl_tests"]
