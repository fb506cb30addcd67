"""The `fermoe` command: the in-process commands (generate, logits, convert, synth, ppl,
compare, prune, bench) and the clients of a running coordinator (submit, demo, serve).
The coordinator and the workers import nothing from here."""
