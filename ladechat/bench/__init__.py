"""`ladechat bench`: prompt sets answered by several methods side by side (prompts), what one
step costs as it feeds more tokens (steps), serving overhead (serving)."""
