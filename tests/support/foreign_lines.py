"""Lines other libraries print that a user cannot act on, found in a job's output.

Independent of the project's filters (fp8_plugin/tools/quiet.py): a line is foreign when it has
the marks other libraries' warnings and logs carry: a source path inside site-packages (Python
warnings), torch's glog-style prefix (``W1127 15:51:42.300000 10164 torch/...``), a library's
"Failed to load" of a shared object, or an advertising tip. Progress bars, transformers' model
loading report and Lightning's device summary are not counted (the issue that asked for a quiet
run leaves them out).
"""

import re

__all__ = ["foreign_lines"]

_MARKS = re.compile(r"site-packages/|^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ |Failed to load .*\.so|💡 Tip:")


def foreign_lines(output: str) -> list[str]:
    """The foreign lines of ``output`` (stdout and stderr together)."""
    return [line for line in output.splitlines() if _MARKS.search(line)]
