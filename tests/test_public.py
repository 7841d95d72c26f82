"""The top-level package: every public name resolves, and `import prepack` stays light."""

from __future__ import annotations

import subprocess
import sys

import prepack


def test_every_public_name_resolves_to_what_its_module_defines():
    for name in prepack.__all__:
        value = getattr(prepack, name)
        assert getattr(value, "__name__", name) == name, name  # a function or class, not a module
    assert set(dir(prepack)) == set(prepack.__all__)


def test_import_prepack_loads_neither_torch_nor_transformers():
    code = "import sys, prepack; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
