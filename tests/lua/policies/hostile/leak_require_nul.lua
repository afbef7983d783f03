-- A NUL would cut the file name short in C: "clean\0" must not open clean (or anything).
return require "clean\0"
