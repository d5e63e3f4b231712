"""Run from outside the source tree, in a venv where only the built wheel (and torch) is
installed: every public module imports (the integrations whose framework is absent are
found, not imported), and FusedZeroAdam takes one step that matches torch.optim.Adam (its
defaults are Adam's: no weight decay unless given)."""

import importlib
import importlib.util
import os
import pkgutil

import torch

import zerokern

assert not os.path.exists(os.path.join(os.getcwd(), "zerokern")), "run this outside the source tree"
assert "site-packages" in zerokern.__file__, zerokern.__file__
needs = {"zerokern.integrations.deepspeed": "deepspeed", "zerokern.integrations.hf": "transformers",
         "zerokern.integrations.accelerate": "accelerate"}
names = [m.name for m in pkgutil.walk_packages(zerokern.__path__, "zerokern.")
         if not m.name.endswith("__main__")]  # a CLI entry point runs when imported
for name in ("zerokern.integrations.hf", "zerokern.integrations.accelerate", "zerokern.integrations.dcp",
             "zerokern.integrations.deepspeed", "zerokern.optim.state_dict", "zerokern.optim.grad_scaler"):
    assert name in names, f"{name} is not in the wheel"
imported = []
for name in names:
    dep = needs.get(name)
    if dep is not None and importlib.util.find_spec(dep) is None:
        continue
    importlib.import_module(name)
    imported.append(name)

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
ref = torch.nn.Linear(8, 4)
ref.load_state_dict(model.state_dict())
opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-2)
ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
x = torch.randn(3, 8)
for m, o in ((model, opt), (ref, ref_opt)):
    m(x).square().mean().backward()
    o.step()
diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
assert diff < 1e-6, diff
print(f"wheel: {len(imported)} modules imported ({len(names)} in the package), one step matches "
      f"Adam's (max diff {diff:.1e}); backends {zerokern.available_backends()}")
