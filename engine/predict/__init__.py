"""Below the runtime: the predictors it asks for the experts ahead, and the prompt sets."""
