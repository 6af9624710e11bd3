"""Make the Triton interpreter of this process as strict as the oldest admitted one about
run-time scalars (used by the ``triton_*_cases.py`` files, which run under TRITON_INTERPRET=1).

The interpreters of triton <= 3.6 turn a run-time scalar (a kernel argument or a loaded
value, held as a 1-element array) into a Python int with ``int(array)``, which numpy >= 2.4
refuses ("only 0-dimensional arrays can be converted to Python scalars"); later interpreters
squeeze first. So a kernel whose loop bound is read at run time (``range(0, n)``) runs under
triton 3.9 but fails under 3.6. :func:`strict_scalar_index` makes the interpreter refuse it
here too, so that every triton's test run catches such a kernel.
"""

from __future__ import annotations

import inspect


def strict_scalar_index() -> bool:
    """Patch this triton's interpreter (if it has the hook) so that using a run-time scalar
    as a Python int raises ``TypeError``. Returns whether it was patched."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - no triton
        return False
    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fewbit_strict", False) or len(inspect.signature(orig).parameters) != 2:
        return False

    def refuse(self):
        raise TypeError(
            "a run-time scalar used as a Python int (a loop bound read at run time?): the interpreters "
            "of triton <= 3.6 fail on it with numpy >= 2.4; use a constexpr trip count"
        )

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", refuse)

    patched._fewbit_strict = True
    interpreter._patch_lang_tensor = patched
    return True
