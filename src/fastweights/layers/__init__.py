"""nn.Modules, one per mixer, all with ``forward(x, state=None, cu_seqlens=None) -> (y, state)``,
``state_size()``, its options (the keyword-only parameters of its constructor) and its
context-parallel strategy (see ``base.Mixer``)."""

from .aft import AFTConv, AFTFull, AFTLocal, AFTSimple
from .base import Mixer
from .fla_deltanet import FlaDeltaNet
from .fla_retnet import FlaMultiScaleRetention
from .fwp import DeltaNet, LinearAttention
from .gated_delta import GatedDeltaNet
from .glu import GLU
from .infini import InfiniAttention
from .norms import RMSNorm, SRMSNorm
from .softmax import SoftmaxAttention
from .transnormer import DiagAttention, NormAttention
from .ttt import TTTMLP, TTTLinear

__all__ = [
           "GLU",
           "TTTMLP",
           "AFTConv",
           "AFTFull",
           "AFTLocal",
           "AFTSimple",
           "DeltaNet",
           "DiagAttention",
           "FlaDeltaNet",
           "FlaMultiScaleRetention",
           "GatedDeltaNet",
           "InfiniAttention",
           "LinearAttention",
           "Mixer",
           "NormAttention",
           "RMSNorm",
           "SRMSNorm",
           "SoftmaxAttention",
           "TTTLinear",
]
