"""On the PYTHONPATH of vision-language replicas on the CPU build of vLLM only (never of the
project's environment, never of text replicas): ``cua_rollout.model.fleet.launch`` puts this
directory
there, with the isolated torchvision that ``scripts/setup_env.sh --vlm`` installs.

vLLM's Qwen2-VL / Qwen2.5-VL code needs torchvision (transformers' image and video processors
import it). PyPI's torchvision for this torch is a CUDA build: its compiled ops library does
not load against the CPU torch, and torchvision then fails at import, registering fake kernels
for ``torchvision::nms`` and ``torchvision::qnms``, operators its missing library would have
declared. This hook declares those two schemas (no kernels: nothing on the serving path calls
them) just before torchvision's ``_meta_registrations`` runs, and only when the compiled ops did
not load. It imports nothing until torchvision is imported.
"""

import importlib.abc
import sys

__all__: list[str] = []

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_libraries = []  # a torch.library.Library undoes its definitions when collected: keep it


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _TARGET:
            sys.meta_path.remove(self)
            _declare_missing_ops()
        return None  # the normal finders import the module


def _declare_missing_ops():
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops():
        return
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        if not hasattr(torch.ops.torchvision, name):
            lib.define(schema)
    _libraries.append(lib)


sys.meta_path.insert(0, _DeclareTorchvisionOps())
