module libgwtf.local/gwtf

go 1.19
