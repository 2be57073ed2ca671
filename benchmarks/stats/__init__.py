"""The suite's statistics: Student-t intervals (``student_t``), per-run metrics and paired
comparisons (``eval_metrics``), the claims they support (``claims``), and the balanced order
policies run in (``policy_order``)."""
