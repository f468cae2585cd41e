"""Above the runtime: routing traces recorded by decoding through it, the predictors fitted to
them, and their offline replay."""
