package main

import (
	"fmt"
	"runtime/debug"
)

// version is set at link time by release builds
// (-ldflags "-X main.version=v1.2.3"); otherwise it is read from the
// module and VCS information the go command records.
var version = ""

// Version says which ckptd this is: the release, else the commit it was
// built from ("+dirty" when the tree had changes), else "devel".
func Version() string {
	if version != "" {
		return version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	var rev, dirty string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = "+dirty"
			}
		}
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if rev == "" {
		return "devel"
	}
	return fmt.Sprintf("devel-%s%s", rev, dirty)
}
