"""When and how much to draft: the cost-aware policy, the schedules built on it, and the hybrid
proposer that picks a drafter per step."""
