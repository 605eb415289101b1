"""Studies: experiments on what a setting does to training (learning, gradient quality), not timings."""
