"""Search: a trained model on new images and sentences. Embedding new inputs, the two-stage search
index, the retrieve command, the web app and the MLflow pyfunc. Never imports training."""
