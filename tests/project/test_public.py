"""The top-level package: every public name resolves, and `import prepack` stays light."""

from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import MISSING, fields

import prepack


def test_every_public_name_resolves_to_what_its_module_defines():
    for name in prepack.__all__:
        value = getattr(prepack, name)
        assert getattr(value, "__name__", name) == name, name  # a function or class, not a module
    assert set(dir(prepack)) == set(prepack.__all__)


def test_the_vision_classes_are_public():
    from prepack.training.vision_collate import VisionCollator, VisionSpec
    from prepack.training.vision_dataset import ImagePackedDataset

    assert {"ImagePackedDataset", "VisionCollator", "VisionSpec"} <= set(prepack.__all__)
    assert (prepack.ImagePackedDataset, prepack.VisionCollator, prepack.VisionSpec) == (
        ImagePackedDataset, VisionCollator, VisionSpec)


def test_import_prepack_loads_neither_torch_nor_transformers():
    code = "import sys, prepack; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_build_and_build_store_take_the_fields_of_their_option_objects_as_keywords_with_their_defaults():
    from prepack.building.build import Output, Packing
    from prepack.sources.documents import Reading

    for function, option_classes in ((prepack.build, (Reading, Packing, Output)), (prepack.build_store, (Reading, Output))):
        parameters = inspect.signature(function).parameters.values()
        keywords = {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert [p.name for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY] == ["corpus", "out"]
        declared = {
            field.name: inspect.Parameter.empty if field.default is MISSING else field.default
            for options in option_classes
            for field in fields(options)
        }
        assert keywords == declared, function.__name__
