"""Errors raised for bad input: each names the file, the tensor and what was expected."""


class ParityInputError(ValueError):
    """Base class: the input (a checkpoint, a config, a tensor) is not what the format requires."""


class FormatError(ParityInputError):
    """A quantization_config, or a shape, that the format of shared FORMATS.md does not allow."""


class CheckpointError(ParityInputError):
    """A checkpoint directory or file that cannot be read as FORMATS.md describes."""


class DecodeError(ParityInputError):
    """Stored data that does not decode: a code that must not occur, an inconsistent stream."""


class PromptsError(ParityInputError):
    """A prompt file that is not a JSON array of token-id arrays inside the vocabulary."""


class EngineUnsupported(RuntimeError):
    """The engine cannot serve this checkpoint here (a kernel its build lacks, a dtype its method refuses)."""
