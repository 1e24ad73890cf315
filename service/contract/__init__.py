"""The contracts every process shares: the error codes and their HTTP meaning (errors), how a
request's deadline is fixed and travels (deadlines), and the gang's status as typed models
(gang_status). They import nothing of the subsystems."""
