#!/usr/bin/env python3
"""torchvision's model classes offloaded on emu, on this machine's CPU torch: classification
(convolutional networks with batch norm, vision transformers), segmentation, detection and
video models, each built without weights (random init, fp32), offloaded at --fraction of its
bytes and called --steps times beside a resident twin:

  eval    outputs bitwise equal, each call moving at least what the budget cannot hold
  train   --train: the twins in train mode (batch norm updates its running statistics in place
          each call: the offload writes them through to the host copies); outputs, the input's
          gradient and every running statistic bitwise equal
  removed remove() gives the resident model back

torchvision is Debian's python3-torchvision (not a dependency of the project: install it to
run this).

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \\
        /usr/bin/python3 bench/dev/torchvision_zoo.py [--train] [NAME ...]
"""
from __future__ import annotations

import argparse
import copy
import traceback
from typing import Any, Callable, Dict, Iterator, Tuple

import torch

import spillway.torch as spt

MiB = 1 << 20


def cases() -> Iterator[Tuple[str, Callable[[], torch.nn.Module], Tuple[int, ...]]]:
    """(name, builder, input shape)."""
    from torchvision import models as M
    from torchvision.models import detection as D
    from torchvision.models import segmentation as S
    from torchvision.models import video as V
    img = (2, 3, 96, 96)
    for name in ("resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "mobilenet_v2", "mobilenet_v3_large",
                 "efficientnet_b0", "efficientnet_v2_s", "convnext_tiny", "regnet_y_400mf", "densenet121",
                 "squeezenet1_1", "shufflenet_v2_x1_0", "mnasnet1_0", "vgg11_bn", "alexnet", "swin_t"):
        yield name, (lambda n=name: getattr(M, n)(weights=None, num_classes=100)), (img if name != "alexnet" else (2, 3, 128, 128))
    yield "googlenet", lambda: M.googlenet(weights=None, aux_logits=False, init_weights=True), img
    yield "inception_v3", lambda: M.inception_v3(weights=None, aux_logits=False, init_weights=True), (2, 3, 160, 160)
    yield "vit_b_32", lambda: M.vit_b_32(weights=None, image_size=96), img
    yield "maxvit_t", lambda: M.maxvit_t(weights=None), (1, 3, 224, 224)
    yield "deeplabv3_mobilenet", lambda: S.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None), img
    yield "lraspp_mobilenet", lambda: S.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None), img
    yield "fcn_resnet50", lambda: S.fcn_resnet50(weights=None, weights_backbone=None, aux_loss=True), img
    yield "fasterrcnn_mobilenet", lambda: D.fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None,
                                                                                  num_classes=10), (2, 3, 128, 128)
    yield "retinanet_resnet50", lambda: D.retinanet_resnet50_fpn(weights=None, weights_backbone=None, num_classes=10,
                                                                 min_size=128, max_size=128), (2, 3, 128, 128)
    yield "ssdlite_mobilenet", lambda: D.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                       num_classes=10), (2, 3, 128, 128)
    yield "r3d_18", lambda: V.r3d_18(weights=None), (1, 3, 4, 64, 64)


# Models most of whose bytes are one linear layer, which a unit holds whole: a larger share of
# them (Faster R-CNN's box head 49 of 73 MiB, VGG's first classifier layer 392 of 507 MiB)
_LARGE_LAYER = {"fasterrcnn_mobilenet": 0.8, "vgg11_bn": 0.85, "alexnet": 0.7, "mobilenet_v3_large": 0.6}


def flat(out: Any) -> list:
    """The tensors of a model's output (a tensor, a dict of them, a list of dicts)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in flat(out[k])]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flat(o)]
    return []


def equal(a: Any, b: Any) -> bool:
    fa, fb = flat(a), flat(b)
    return len(fa) == len(fb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(fa, fb))


def run(name: str, build: Callable[[], torch.nn.Module], shape: Tuple[int, ...], args) -> Dict[str, Any]:
    torch.manual_seed(0)
    ref = build().requires_grad_(False)
    ref.train(args.train)
    model = copy.deepcopy(ref)
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    fraction = _LARGE_LAYER.get(name, args.fraction)
    budget = max(int(total * fraction) // (2 * MiB), 1) * (2 * MiB)
    off = spt.offload(model, budget=budget, backend="emu", vmm=args.vmm)
    detection = name.split("_")[0] in ("fasterrcnn", "retinanet", "ssdlite")
    moved, same, grads = [], True, True
    for i in range(args.steps):
        g = torch.Generator().manual_seed(i)
        x = torch.rand(*shape, generator=g)
        inputs = list(x) if detection else x
        if args.train and not detection:
            xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            before = off.context.stats()["bytes_h2d"]["total"]
            torch.manual_seed(100 + i)  # dropout and stochastic depth draw the same numbers in both
            a = model(xa)
            moved.append(off.context.stats()["bytes_h2d"]["total"] - before)
            torch.manual_seed(100 + i)
            b = ref(xb)
            sum(t.float().square().sum() for t in flat(a)).backward()
            sum(t.float().square().sum() for t in flat(b)).backward()
            grads &= torch.equal(xa.grad, xb.grad)
        else:
            if detection and args.train:  # detection models need targets to train: eval only
                model.eval()
                ref.eval()
            with torch.no_grad():
                before = off.context.stats()["bytes_h2d"]["total"]
                a = model(inputs)
                moved.append(off.context.stats()["bytes_h2d"]["total"] - before)
                b = ref(inputs)
        same &= equal(a, b)
    stats = all(torch.equal(p, q) for p, q in zip(model.buffers(), ref.buffers()))
    largest = max(u.nbytes for u in off.units)
    res = {"MiB": total / MiB, "units": len(off.units), "largest": largest / MiB, "moved": moved[-1] / MiB,
           "must": (total - budget) / MiB, "bitwise": same and grads, "buffers": stats,
           "moving": min(moved) >= total - budget}
    off.remove()
    with torch.no_grad():
        model.eval()
        ref.eval()
        x = torch.rand(*shape, generator=torch.Generator().manual_seed(99))
        res["removed"] = equal(model(list(x) if detection else x), ref(list(x) if detection else x))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--train", action="store_true", help="train mode: batch norm statistics, the input's gradient")
    ap.add_argument("--fraction", type=float, default=0.4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--vmm", default="on", choices=("on", "off"))
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, emu, budget {args.fraction:.0%} of each model, "
          f"{'train' if args.train else 'eval'} mode, {args.steps} calls")
    print(f"{'model':22}{'MiB':>8}{'units':>6}{'moved':>8}{'must':>8}  moving bitwise buffers removed")
    failed = 0
    for name, build, shape in cases():
        if args.names and name not in args.names:
            continue
        try:
            r = run(name, build, shape, args)
        except Exception:
            failed += 1
            print(f"{name:22} FAILED")
            traceback.print_exc()
            continue
        ok = r["moving"] and r["bitwise"] and r["buffers"] and r["removed"]
        failed += not ok
        print(f"{name:22}{r['MiB']:8.1f}{r['units']:6d}{r['moved']:8.1f}{r['must']:8.1f}  {str(r['moving']):7}"
              f"{str(r['bitwise']):8}{str(r['buffers']):8}{r['removed']}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
