"""Why a patch is refused: its own module, so that light processes (the patch store,
signature checks) can name these errors without importing the codec and torch."""


class PatchError(ValueError):
    """A patch that cannot be trusted; the subclass says why."""


class UnknownFormat(PatchError):
    pass


class TruncatedPatch(PatchError):
    pass


class CorruptPatch(PatchError):
    pass


class PatchTooLarge(PatchError):
    pass


class BaseMismatch(PatchError):
    pass


class TensorMismatch(PatchError):
    pass


class TargetMismatch(PatchError):
    pass
