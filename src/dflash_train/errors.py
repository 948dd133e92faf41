"""The one base class of errors a user can cause (paths, configs, data, mismatched models).

The CLI prints these as one line, `error: <message>`, and exits 2; anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Raised with one sentence that names the problem and the fix."""
