package attempt

import (
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		id string
		ok bool
	}{
		{"a", true},
		{"slurm-4242.3", true},
		{"run_0", true},
		{strings.Repeat("a", MaxLen), true},
		{"", false},
		{strings.Repeat("a", MaxLen+1), false},
		{".", false},
		{"..", false},
		{".hidden", false},
		{"../x", false},
		{"a/b", false},
		{"Upper", false},
		{"sp ace", false},
		{"nul\x00", false},
		{"é", false},
	} {
		if err := Check(tc.id); (err == nil) != tc.ok {
			t.Errorf("Check(%q) = %v, want ok %v", tc.id, err, tc.ok)
		}
	}
}
