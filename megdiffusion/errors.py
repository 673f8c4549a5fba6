"""The base class of the errors megdiffusion reports to its users; importing it loads no MegEngine."""


class MegdiffusionError(Exception):
    """Bad input, or a run that cannot go on; the message is one line that says what to change.

    The scripts print it as ``error: <message>`` and exit with ``exit_code``.
    """

    exit_code = 2


def one_line(error):
    """The text of an exception raised outside megdiffusion (pickle's, PIL's, numpy's), its lines joined into one:
    what a message embeds after its own words."""
    return " ".join(str(error).split())
