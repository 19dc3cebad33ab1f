"""norm_optim's test suite (a package: its support code is ``tests.support``)."""
