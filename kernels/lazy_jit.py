"""LazyKernel: decorate a Triton kernel at first launch, honouring TRITON_INTERPRET *then*.

``triton.jit`` picks the interpreter or the compiler when it decorates. Decorating at import
would freeze that choice for the whole process (a test that sets ``TRITON_INTERPRET=1`` after
something imported the kernels would get a compiled kernel on a machine without a GPU). This
wrapper keeps one decorated version per mode and picks by the environment at launch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


class LazyKernel:
    """``LazyKernel(fn)[grid](*args)`` like a ``@triton.jit`` function."""

    def __init__(self, fn: Callable[..., Any], **jit_options: Any) -> None:
        self.fn = fn
        self.jit_options = jit_options
        """Keyword arguments of ``triton.jit`` (e.g. ``do_not_specialize``); the interpreter ignores them."""
        self._by_mode: dict[bool, Any] = {}

    def _kernel(self) -> Any:
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if interpret not in self._by_mode:
            import triton
            from triton.runtime.interpreter import InterpretedFunction

            self._by_mode[interpret] = (InterpretedFunction(self.fn) if interpret
                                        else triton.jit(self.fn, **self.jit_options))
        return self._by_mode[interpret]

    def __getitem__(self, grid: Any) -> Any:
        return self._kernel()[grid]
