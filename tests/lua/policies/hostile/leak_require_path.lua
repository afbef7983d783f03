-- A module name that walks out of the policy's directory.
return require "../../../../../../../../tmp/moonshard_hostile_secret"
