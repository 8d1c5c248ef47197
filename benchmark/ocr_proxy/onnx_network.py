"""An ONNX network run node by node in torch, for PP-OCR's detection and recognition networks on a GPU.

    network = OnnxNetwork("ch_PP-OCRv4_rec_infer.onnx").to("cuda")   # the file RapidOCR loads
    logits = network(torch.from_numpy(batch).cuda())                 # what ONNX Runtime's session returns

It covers the operators (at opset 12) that RapidOCR's PP-OCRv4 detection and recognition files use, and refuses any
other in one line. onnx2torch and onnx2pytorch, made for this, import torchvision, whose registry wheels do not load
against the pinned CPU build of torch (`torchvision::nms does not exist`), so they cannot run in CI. Float weights are
buffers (they move with .to(device)); integer constants and shapes stay on the CPU, so that shape arithmetic never
waits for the GPU. tests/test_ocr_proxy.py checks both networks against ONNX Runtime.
"""

from __future__ import annotations

import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper


def _conv(x, weight, bias=None, *, group=1, pads=(0, 0, 0, 0), strides=(1, 1), dilations=(1, 1), **_):
    return F.conv2d(x, weight, bias, strides, pads[:2], dilations, group)


def _conv_transpose(x, weight, bias=None, *, group=1, pads=(0, 0, 0, 0), strides=(1, 1), dilations=(1, 1), **_):
    return F.conv_transpose2d(x, weight, bias, strides, pads[:2], 0, group, dilations)


def _average_pool(x, *, kernel_shape, strides, pads=(0, 0, 0, 0), ceil_mode=0, count_include_pad=0):
    return F.avg_pool2d(x, kernel_shape, strides, pads[:2], bool(ceil_mode), bool(count_include_pad))


def _slice(x, starts, ends, axes=None, steps=None):
    index = [slice(None)] * x.dim()
    axes = range(len(starts)) if axes is None else axes.tolist()
    steps = [1] * len(starts) if steps is None else steps.tolist()
    for axis, start, end, step in zip(axes, starts.tolist(), ends.tolist(), steps):
        index[axis] = slice(start, end, step)
    return x[tuple(index)]


def _reshape(x, shape):
    return x.reshape([x.shape[i] if size == 0 else size for i, size in enumerate(shape.tolist())])


def _divide(a, b):
    return torch.div(a, b, rounding_mode="trunc") if not a.is_floating_point() else a / b


def _softmax(x, *, axis=1):
    # opset 12: the dimensions from axis on are one row
    return F.softmax(x.flatten(axis), -1).reshape(x.shape)


OPERATORS = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": _divide, "Pow": torch.pow, "Sqrt": torch.sqrt,
    "MatMul": torch.matmul, "Relu": torch.relu, "Sigmoid": torch.sigmoid,
    "Clip": lambda x, low=None, high=None: torch.clamp(x, low, high),
    "HardSigmoid": lambda x, *, alpha=0.2, beta=0.5: torch.clamp(alpha * x + beta, 0, 1),
    "Conv": _conv, "ConvTranspose": _conv_transpose, "AveragePool": _average_pool,
    "GlobalAveragePool": lambda x: x.mean((2, 3), keepdim=True),
    "BatchNormalization": lambda x, scale, bias, mean, var, *, epsilon=1e-5, **_: F.batch_norm(
        x, mean, var, scale, bias, False, 0.0, epsilon),
    # nearest, floor, asymmetric: what F.interpolate's "nearest" computes
    "Resize": lambda x, roi=None, scales=None, *, scale_factor: F.interpolate(x, scale_factor=scale_factor),
    "ReduceMean": lambda x, *, axes, keepdims=1: x.mean(tuple(axes), keepdim=bool(keepdims)),
    "Softmax": _softmax, "Transpose": lambda x, *, perm: x.permute(perm),
    "Squeeze": lambda x, *, axes: x.squeeze(tuple(axes)), "Reshape": _reshape, "Slice": _slice,
    "Concat": lambda *xs, axis: torch.cat(xs, axis),
    "Shape": lambda x: torch.tensor(x.shape, dtype=torch.int64),
    "Cast": lambda x, *, to: x.to(getattr(torch, str(helper.tensor_dtype_to_np_dtype(to)))),
}
_RESIZE_MODES = {"mode": b"nearest", "nearest_mode": b"floor", "coordinate_transformation_mode": b"asymmetric"}


class OnnxNetwork(torch.nn.Module):
    """One input, one output; batch-size free where the file is."""

    def __init__(self, path: str):
        super().__init__()
        model = onnx.load(path)
        if max(opset.version for opset in model.opset_import if opset.domain in ("", "ai.onnx")) > 12:
            raise ValueError(f"{path}: opset above 12, which OnnxNetwork does not cover (its Softmax differs)")
        constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        self.nodes = []  # (operator, input names, output name, attributes)
        for node in model.graph.node:
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "Constant":
                constants[node.output[0]] = numpy_helper.to_array(attributes["value"])
                continue
            if node.op_type not in OPERATORS:
                raise ValueError(f"{path}: operator {node.op_type} ({node.name}) is not one OnnxNetwork covers")
            if node.op_type == "Resize":
                if any(attributes.get(k) != v for k, v in _RESIZE_MODES.items()):
                    raise ValueError(f"{path}: Resize {node.name} is not nearest/floor/asymmetric")
                attributes = {"scale_factor": constants[node.input[2]][2:].tolist()}
            if node.op_type in ("Conv", "ConvTranspose", "AveragePool"):
                pads = attributes.get("pads", [0, 0, 0, 0])
                if pads[:2] != pads[2:] or attributes.get("output_padding", [0, 0]) != [0, 0]:
                    raise ValueError(f"{path}: {node.op_type} {node.name} pads unevenly")
                attributes.pop("output_padding", None)
            self.nodes.append((OPERATORS[node.op_type], list(node.input), node.output[0], attributes))
        self.buffer_names = {}  # ONNX name -> buffer name (buffers cannot have dots)
        self.cpu_constants = {}
        for name, value in constants.items():
            tensor = torch.from_numpy(value.copy())
            if tensor.is_floating_point():
                self.buffer_names[name] = f"constant{len(self.buffer_names)}"
                self.register_buffer(self.buffer_names[name], tensor)
            else:
                self.cpu_constants[name] = tensor
        self.input_name, self.output_name = model.graph.input[0].name, model.graph.output[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = {**self.cpu_constants, **{onnx_name: getattr(self, name)
                                            for onnx_name, name in self.buffer_names.items()}}
        values[self.input_name] = x
        for operator, inputs, output, attributes in self.nodes:
            values[output] = operator(*(values[name] if name else None for name in inputs), **attributes)
        return values[self.output_name]
