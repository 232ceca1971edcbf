"""What the strategies share, public inside the package: ``transport`` (process groups, ring
shifts, the all-to-all), ``loop`` (the ring's steps, results, timing, drain on error),
``agreement`` (the ranks agree on each call before anything moves), ``checks`` (the local
argument checks), ``merge`` (the one log-sum-exp merge, fused or float32, row-aware) and
``steps`` (what each ring step computes for each mask kind)."""
