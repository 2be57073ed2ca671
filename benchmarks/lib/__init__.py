"""What every runner uses: the source revision a run records (``revision``) and its progress
bars (``progress``)."""
