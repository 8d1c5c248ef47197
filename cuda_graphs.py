"""CUDA graphs for the transformer's passes without gradient (--cuda-graphs, on CUDA): the rollout's
ODE steps, the base and old adapters' velocities and the validation replay one recorded graph each
instead of launching a small model's ~1,300 kernels one by one from Python.

For models so small that launching kernels costs more host time than the GPU spends running them
(the OCR proxy's 15.5M parameters, many runs sharing one GPU's host): SD3.5-M's kernels are long
enough that the launches hide behind them, and it runs compiled instead.
"""

import warnings

import torch

from lora_adapters import SLOT, _lora_layers

MOST_GRAPHS = 16  # per transformer; a caller whose shapes keep changing runs eagerly past it


class GraphedPasses:
    """Stands in for the transformer's forward: a call without gradient on CUDA replays the CUDA
    graph recorded for its inputs' shapes, dtypes, autocast state and the LoRA tensors its layers
    run (use_adapter points them at an adapter's); the first call of each runs eagerly and records
    the graph. A call with gradient, on the CPU or with other arguments runs eagerly.

    A graph reads the tensors it was recorded with where they lie in memory: the adapters' updates
    (optimizer steps, EMA snapshots, a resume's load) are in place, so it runs their current
    values; the key holds those tensors' addresses, so that another adapter gets its own graph."""

    KEYWORDS = ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections")

    def __init__(self, transformer):
        self.transformer = transformer
        self.eager = transformer.forward
        self.graphs = {}  # key -> (graph, static inputs, static output), or None: runs eagerly

    @classmethod
    def install(cls, transformer) -> "GraphedPasses":
        graphed = cls(transformer)
        transformer.forward = graphed
        return graphed

    def __call__(self, *args, **kwargs):
        inputs = {name: kwargs.get(name) for name in self.KEYWORDS}
        plain = (not args and set(kwargs) == {*self.KEYWORDS, "return_dict"}
                 and not kwargs["return_dict"])
        if (torch.is_grad_enabled() or not plain
                or not all(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs.values())):
            return self.eager(*args, **kwargs)
        key = self.key(inputs)
        if key not in self.graphs and len(self.graphs) < MOST_GRAPHS:
            output = self.eager(**kwargs)  # also the warm-up that recording needs (cuBLAS handles)
            try:
                self.graphs[key] = self.record(inputs)
            except RuntimeError as error:  # e.g. a forked model's forward that waits on the GPU
                warnings.warn(f"--cuda-graphs: a transformer pass could not be recorded, so it "
                              f"runs eagerly: {str(error).splitlines()[0]}", stacklevel=2)
                self.graphs[key] = None
            return output
        if self.graphs.get(key) is None:  # not recorded: it failed, or MOST_GRAPHS were
            return self.eager(**kwargs)
        graph, static_inputs, static_output = self.graphs[key]
        for name, value in inputs.items():
            static_inputs[name].copy_(value)
        graph.replay()
        return (static_output.clone(),)  # the next replay overwrites the static output

    def key(self, inputs: dict) -> tuple:
        layers = _lora_layers(self.transformer)
        adapters = tuple((layer._disable_adapters, layer.lora_A[SLOT].weight.data_ptr(),
                          layer.lora_B[SLOT].weight.data_ptr(), layer.scaling[SLOT])
                         for layer in layers)
        shapes = tuple((x.shape, x.dtype, x.device) for x in inputs.values())
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        return shapes, autocast, adapters

    def record(self, inputs: dict):
        static_inputs = {name: value.clone() for name, value in inputs.items()}
        graph = torch.cuda.CUDAGraph()
        # autocast's cache of cast weights would hand the graph a copy that is freed when the
        # caller's autocast region ends: the casts are recorded into the graph instead
        cache_off = torch.autocast("cuda", torch.get_autocast_dtype("cuda"), cache_enabled=False,
                                   enabled=torch.is_autocast_enabled("cuda"))
        # thread_local: a scorer thread may launch its own kernels meanwhile
        with cache_off, torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static_output = self.eager(**static_inputs, return_dict=False)[0]
        return graph, static_inputs, static_output
