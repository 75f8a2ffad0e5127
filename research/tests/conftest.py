"""The research scripts' tests keep a ``slow`` marker of their own: ``-m "not slow"`` leaves out
the long federation comparisons (research/README.md, "Running"). The project's suite has no
such marker: its lanes are folders (README, "Where things are")."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long federation comparison (-m 'not slow' leaves it out)")
