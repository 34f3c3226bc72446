"""The wire protocol both sides share: keys, messages, Lua scripts, chunk hashing, fingerprints."""
