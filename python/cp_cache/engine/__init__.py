"""What the strategies share: transport, the ring's loop, the ranks' agreement, the exchange plan and the merge."""
