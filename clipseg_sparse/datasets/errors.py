"""The one error type for a missing or malformed dataset."""

from ..errors import UserValueError

DOCS = "docs/datasets.md"


class DatasetError(UserValueError):
    """A dataset that is missing or not in the expected layout; the message names the path to fix."""
