"""nn.Modules, one per mixer, all with ``forward(x, state=None) -> (y, state)`` and ``state_size()``."""

from .aft import AFTConv, AFTFull, AFTLocal, AFTSimple
from .base import Mixer
from .fwp import DeltaNet, LinearAttention
from .infini import InfiniAttention
from .softmax import SoftmaxAttention
from .glu import GLU
from .transnormer import DiagAttention, NormAttention, SRMSNorm
from .ttt import TTTMLP, TTTLinear

__all__ = ["Mixer", "LinearAttention", "DeltaNet", "SoftmaxAttention", "InfiniAttention",
           "NormAttention", "DiagAttention", "GLU", "SRMSNorm",
           "AFTFull", "AFTLocal", "AFTSimple", "AFTConv",
           "TTTLinear", "TTTMLP"]
