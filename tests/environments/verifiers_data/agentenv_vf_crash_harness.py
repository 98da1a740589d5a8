"""A verifiers harness (verifiers' own v1 API) whose agent program crashes on launch."""

from verifiers.v1.harnesses.null import NullHarness


class CrashingHarness(NullHarness):
    async def launch(self, *args, **kwargs):
        raise RuntimeError("the harness program crashed on purpose")


__all__ = ["CrashingHarness"]
