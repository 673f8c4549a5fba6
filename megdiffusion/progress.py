"""Every progress bar of the package: tqdm's, redrawn in place on a terminal; where stderr is not a terminal (a log
file, a pipe) a line every ``LINE_SECONDS`` instead of carriage-return redraws."""
import sys

from tqdm import tqdm

LINE_SECONDS = 5.0  # between the lines of a bar written to a file; a bar done sooner writes none
LINE_FORMAT = "{desc} {n:.0f}/{total_fmt} {unit} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class _Lines:
    """The stream tqdm writes to when stderr is not a terminal: each redraw becomes one whole line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self):
        self.stream.flush()


def progress_bar(iterable=None, **options):
    """A tqdm bar on stderr with tqdm's ``options`` (total, desc, unit, initial, leave, disable, bar_format, ...)."""
    if sys.stderr.isatty():
        return tqdm(iterable, file=sys.stderr, **{"dynamic_ncols": True, **options})
    options.update(bar_format=LINE_FORMAT, mininterval=LINE_SECONDS, delay=LINE_SECONDS, ascii=True)
    return tqdm(iterable, file=_Lines(sys.stderr), **options)
