"""Search: a trained model on new images and sentences. Embedding new inputs, the certified search
index, the retrieve command, the web app and the MLflow pyfunc. Never imports training."""
