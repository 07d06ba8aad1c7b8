"""Errors for bad input. Each carries a one-line message naming the file and the problem;
the CLI prints it and exits with code 2, without a traceback."""
from __future__ import annotations


class EdgeLLMError(Exception):
    """Base class: a problem with the user's input, not a bug."""

    exit_code = 2


class ModelNotFoundError(EdgeLLMError):
    pass


class ModelFormatError(EdgeLLMError):
    """A file exists but is not a model we can read (empty, truncated, corrupt)."""


class UnsupportedModelError(EdgeLLMError):
    """A readable model of an architecture or type we do not support."""


class ContextOverflowError(EdgeLLMError):
    """The prompt (plus the requested tokens) does not fit the context."""


class QuantizationError(EdgeLLMError):
    """Bad quantization settings or shapes."""


class TokenizerError(EdgeLLMError):
    pass


class OutputError(EdgeLLMError):
    """An output could not be written (read-only dir, full disk, interrupted)."""
