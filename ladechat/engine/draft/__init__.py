"""The draft sources a step verifies, and the priced tree that merges them (tree): the Jacobi
window (window) and its n-gram pool (pool), the recycled top-k (recycle), suffix matches in the
conversation (suffix) and in the store of past answers (store)."""
