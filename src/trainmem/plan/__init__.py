"""What to change: the planner (search), the advisor (the brief's ladder), the explainer (the brief's
follow-up questions with the user's numbers), and accelerator presets.

>>> from trainmem.plan import load_gpu, parse_size
>>> load_gpu("h100-80gb").gpus_per_node, parse_size("80GiB")
(8, 85899345920)
"""

from trainmem.plan.advise import Advice, AdviceStep, advise
from trainmem.plan.cost import CostModel, StepTime, step_time
from trainmem.plan.explain import Answer, Explanation, explain
from trainmem.plan.hardware import GPU, Reserve, list_gpus, load_gpu, parse_size
from trainmem.plan.ranks import per_rank_peak
from trainmem.plan.search import Candidate, Plan, SearchSpace, plan

__all__ = [
    "plan", "Plan", "Candidate", "SearchSpace",
    "advise", "Advice", "AdviceStep",
    "explain", "Explanation", "Answer",
    "GPU", "Reserve", "list_gpus", "load_gpu", "parse_size",
    "CostModel", "StepTime", "step_time",
    "per_rank_peak",
]
