"""The backends the front ends answer through (base.Backend): a model in this process (local, built
by opener from a command's load options and settings),
one still loading (pending), one behind an OpenAI-compatible server (remote); detok turns a local
model's token ids into the text they all stream."""
