-- A host function as parallelize runs for the policy, in its budget, its error naming it.
return { parallelize = error }
