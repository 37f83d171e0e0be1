"""A step's logits to each request's output: grammar masks, logits processing, the draw, stops, text."""
