"""Commands beside training (`imagenet-elastic COMMAND`): benchmark, export, pack, plot."""
