"""Let torchvision import beside a torch whose ABI its compiled ops do not match.

Installed with a .pth line into the SGLang engine's environment (scripts/engines.sh). SGLang
imports torchvision at start (through transformers' image processors); torchvision 0.28's
_C library does not load beside torch 2.13.0+cpu, and torchvision's _meta_registrations.py
then fails on `register_fake("torchvision::nms")` / `("torchvision::qnms")`, ops that only _C
defines. Just before torchvision is first imported, this tries _C itself; when it does not
load, it defines those two schemas, which a text model never calls.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_LIBS = []  # a torch.library.Library is dropped with its last reference


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        try:
            _define_missing_ops()
        except Exception:  # torchvision's own error says more than ours would
            pass
        return None  # the normal finders import torchvision


def _define_missing_ops() -> None:
    import torch

    spec = importlib.util.find_spec("torchvision")
    folder = (spec.submodule_search_locations or [""])[0] if spec else ""
    for name in os.listdir(folder) if folder else ():
        if name.startswith("_C.") and name.endswith((".so", ".pyd")):
            try:
                torch.ops.load_library(os.path.join(folder, name))
                return
            except (ImportError, OSError):
                break
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBS.append(lib)


def install() -> None:
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
