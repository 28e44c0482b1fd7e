import os

import torch
from hypothesis import settings

torch.set_num_threads(min(2, os.cpu_count() or 1))
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("ci")
