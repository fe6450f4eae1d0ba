"""Run configs: each file has get_config(arg) and its docstring is the run command."""
