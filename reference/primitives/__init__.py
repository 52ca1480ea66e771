"""The primitives every layout is built from: write atomically (`atomic`), hash and digest (`integrity`), load
with weights_only=True (`loading`), a state as bytes in memory and back (`encoding`), schema versions and
migrations (`schema`), and a payload as a tree (`tree`)."""
