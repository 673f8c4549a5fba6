"""The base class of the errors megdiffusion reports to its users; importing it loads no MegEngine."""


class MegdiffusionError(Exception):
    """Bad input, or a run that cannot go on; the message is one line that says what to change.

    The scripts print it as ``error: <message>`` and exit with ``exit_code``.
    """

    exit_code = 2
