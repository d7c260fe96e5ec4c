"""Generation: the one API (`generator`: Generator, generate, load_model), the user's sampling
settings (`sampling`), harmony chat rendering (`chat`), streaming text (`text_stream`) and the
`generate` command (`cli`). The compiled decode loop itself is jax_bridge/decoding.py."""
